"""The built-in engine: torch decoding that emulates a profile's number formats."""
