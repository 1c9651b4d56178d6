"""vLLM integration. Only this package imports vLLM."""
