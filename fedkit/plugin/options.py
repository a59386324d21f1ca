"""The base class of plugin options: unknown keys are errors, values are validated."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class PluginOptions(BaseModel):
    """Subclass this for a plugin's nested ``Options``: fields are the recipe options.

    Unknown keys are rejected (a misspelt option is an error naming the key, with a
    did-you-mean), and the options are frozen, so both sides of a run see the same values.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
