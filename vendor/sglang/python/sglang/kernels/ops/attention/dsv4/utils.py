def make_name(name: str) -> str:
    return f"dpsk_v4_{name}"
