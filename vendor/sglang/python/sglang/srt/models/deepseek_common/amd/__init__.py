# AMD-specific DeepSeek common model helpers.
