"""The base of every config section. Import-light: pydantic only (no torch, Megatron or vLLM).

Every field carries a docstring; `megatron-rl config --explain` prints them."""

from __future__ import annotations

from typing import Any, get_args

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator


def _is_number_type(annotation: Any) -> bool:
    """Whether a field annotation is int or float (also inside `X | None`), but not bool."""
    if annotation in (int, float):
        return True
    return any(arg in (int, float) for arg in get_args(annotation))


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, field docstrings are descriptions."""

    # No inf/NaN anywhere: a deadline of inf overflows later (OverflowError in the middle of a run), NaN compares false.
    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, use_attribute_docstrings=True, allow_inf_nan=False
    )

    @field_validator("*", mode="before")
    @classmethod
    def _no_booleans_for_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        # YAML reads yes/no/true/false as booleans and pydantic would take them as 1/0 without a word.
        field = cls.model_fields.get(info.field_name or "")
        if isinstance(value, bool) and field is not None and _is_number_type(field.annotation):
            raise ValueError("must be a number, not true/false")
        return value
