"""tandem: an LLM inference engine that makes the prefill/decode trade-off measurable."""

from tandem.core.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # LLM pulls in torch; import it lazily so that `tandem.core` stays torch-free to import.
    if name == "LLM":
        from tandem.llm import LLM

        return LLM
    raise AttributeError(name)
