"""specserve: speculative decoding on one paged KV pool shared by a draft and a target model."""

__version__ = "0.1.0"


def __getattr__(name):
    # Lazy, so `import specserve.config` does not pull in torch and the engine.
    if name == "LLM":
        from specserve.llm import LLM

        return LLM
    if name == "SamplingParams":
        from specserve.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'specserve' has no attribute {name!r}")


__all__ = ["LLM", "SamplingParams", "__version__"]
