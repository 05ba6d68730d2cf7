"""The engine layer: ``LLMEngine`` (add_request / step / abort), the offline ``LLM`` API, model
resolution (``default``, local folders, GGUF files converted once into a cached folder), the
tokenizer wrapper and the incremental detokenizer with stop strings."""
