"""runtime: the serving engine. ``runtime.LLM(model).generate(prompts, SamplingParams(...))`` runs it offline
(runtime/llm.py); ``compress serve`` puts it behind an OpenAI-compatible HTTP server (runtime/serve/)."""

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    if name == "LLM":
        from runtime.llm import LLM

        return LLM
    if name == "SamplingParams":
        from runtime.sequence import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'runtime' has no attribute {name!r}")
