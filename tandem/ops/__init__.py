"""Op dispatch: each hot op's plain torch form and its faster forms, chosen once per model.

``reference.py`` holds the plain torch form of every op (it always works, on any device and
dtype); ``dispatch.py`` decides, when a model is built, which implementation each op uses and
records why. Model code calls the chosen ops through the ``OpTable`` it was built with and never
tests for devices, dtypes or kernels itself.
"""
