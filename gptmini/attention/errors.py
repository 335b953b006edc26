"""The one error an attention module, setting or scheme raises for an argument it refuses,
naming the argument: a module used alone reports it as it is, and the model's config,
which builds modules from its fields, names its own field for it (GPTConfig's ConfigError)."""

__all__ = ["ArgumentError"]


class ArgumentError(ValueError):
    """`argument`'s `value` refused, and the `fix`."""

    def __init__(self, argument: str, value: object, fix: str):
        super().__init__(f"{argument}={value!r} is invalid: {fix}")
        self.argument, self.value, self.fix = argument, value, fix
