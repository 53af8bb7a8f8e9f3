"""Emission: an analysed spec and its plan to the source text of a standalone kernel module (`module.render`).

Nothing is imported here: the package imports emit/static/shared.py (the facts it shares with every
generated module) from the planner, which comes before emission.
"""
