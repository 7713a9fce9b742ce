"""CI utilities for SGLang test infrastructure."""
