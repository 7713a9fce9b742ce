# Ollama-compatible API for SGLang
