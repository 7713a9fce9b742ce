# Copied and adapted from: https://github.com/hao-ai-lab/FastVideo

import math
import os
from dataclasses import fields
from operator import attrgetter
from typing import Any


def optional_positive_finite_float(value: Any, field_name: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{field_name} must be a number")
    out = float(value)
    if not math.isfinite(out) or out <= 0.0:
        raise ValueError(f"{field_name} must be a positive finite number")
    return out


def expand_path_fields(obj) -> None:
    """Expand paths in dataclass configuration without modifying other fields."""
    for f in fields(obj):
        value = attrgetter(f.name)(obj)
        if f.name.endswith("_path") and isinstance(value, str):
            setattr(obj, f.name, os.path.expanduser(value))
        elif f.name.endswith("_path") and isinstance(value, list):
            setattr(
                obj,
                f.name,
                [os.path.expanduser(v) if isinstance(v, str) else v for v in value],
            )
        elif f.name.endswith("_paths") and isinstance(value, dict):
            setattr(
                obj,
                f.name,
                {
                    k: os.path.expanduser(v) if isinstance(v, str) else v
                    for k, v in value.items()
                },
            )


def update_config_from_args(
    config: Any,
    args_dict: dict[str, Any],
    prefix: str = "",
    pop_args: bool = False,
    *,
    exclude: tuple[str, ...] = (),
) -> bool:
    """
    Update configuration object from arguments dictionary.

    Args:
        config: The configuration object to update
        args_dict: Dictionary containing arguments
        prefix: Prefix for the configuration parameters in the args_dict.
               If None, assumes direct attribute mapping without prefix.
    """
    # Handle top-level attributes (no prefix)
    args_not_to_remove = [
        "model_path",
        "disable_autocast",
    ]
    args_to_remove = []
    if prefix.strip() == "":
        for key, value in args_dict.items():
            if key not in exclude and hasattr(config, key) and value is not None:
                if key == "text_encoder_precisions" and isinstance(value, list):
                    setattr(config, key, tuple(value))
                else:
                    setattr(config, key, value)
                if pop_args:
                    args_to_remove.append(key)
    else:
        # Handle nested attributes with prefix
        prefix_with_dot = f"{prefix}."
        for key, value in args_dict.items():
            if key.startswith(prefix_with_dot) and value is not None:
                attr_name = key[len(prefix_with_dot) :]
                if attr_name in exclude:
                    continue
                if hasattr(config, attr_name):
                    setattr(config, attr_name, value)
                if pop_args:
                    args_to_remove.append(key)

    if pop_args:
        for key in args_to_remove:
            if key not in args_not_to_remove:
                args_dict.pop(key)

    return len(args_to_remove) > 0
