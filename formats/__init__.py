"""First-party plugins (mapped to infer.<this folder>); see infer.plugins.hookspecs."""

# The Mamba-2 families' GGUF rows (mamba2, granitehybrid, falcon-h1) are built by
# gguf_ssm, which adds them to gguf_arch.ARCHITECTURES when imported: importing it here,
# with the package, puts them in the table wherever the table is read.
from . import gguf_ssm  # noqa: E402,F401
