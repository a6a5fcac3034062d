"""An example service built only on guards' public API."""
