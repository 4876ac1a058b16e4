"""Several engine replicas behind one OpenAI endpoint, on Ray Serve (``docs/scale-out.md``).

Nothing here is imported by the single-process server: Ray is only needed with ``--replicas``."""
