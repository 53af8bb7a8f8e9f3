"""Emission: an analysed spec and its plan to the source text of a standalone kernel module (`module.render`).

Nothing is imported here, so importing a module of emit/ (as static/*.py's linting imports do) runs
none of the rest.
"""
