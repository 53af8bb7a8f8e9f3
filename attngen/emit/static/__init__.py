"""The generated module's fixed code as real Python files: the emitter inlines each below its marker line.

Above the marker, a file holds only its docstring and the imports that let it be linted; the module
inlines plan/shared.py (the facts the planner shares with every module, in the same form) before them
(attngen.emit.module.STATIC_PATHS). The names a module's generated preamble and kernel templates
define are pyflakes builtins there (attngen.emit.module.LINT_BUILTINS).
"""
