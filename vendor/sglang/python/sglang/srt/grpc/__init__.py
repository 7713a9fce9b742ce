# SGLang gRPC module
