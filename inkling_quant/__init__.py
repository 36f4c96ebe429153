"""inkling-quant: streaming NVFP4/MXFP8 conversion and verification for Inkling 2 Small."""

__version__ = "0.1.0"
