"""The front end: spec text to parse tree (parser) and parse tree to typed IR (lower)."""
