"""Built-in search backends for SGLang entrypoints."""
