# SGLang multimodal module
