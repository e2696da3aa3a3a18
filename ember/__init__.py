"""ember: a compact, fast LLM inference engine for one GPU or a CPU."""

from ember.platform import cap_torch_isa

cap_torch_isa()  # EMBER_CPU_ISA=avx2 holds torch's CPU code to AVX2 too: before torch first runs an op

from ember.config import EngineConfig  # noqa: E402
from ember.outputs import CompletionOutput, RequestOutput  # noqa: E402
from ember.sampling import SamplingParams  # noqa: E402
from ember.structured_params import StructuredOutputsParams  # noqa: E402


def __getattr__(name):
    # LLM pulls in torch and the model stack; import it lazily so `import ember` stays light.
    if name == "LLM":
        from ember.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "EngineConfig", "RequestOutput", "CompletionOutput"]
