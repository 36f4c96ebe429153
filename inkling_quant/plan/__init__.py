"""Planning a vLLM deployment: `inkling-quant plan` (docs/budget.md)."""
