"""The generated module's fixed code as real Python files: the emitter inlines each below its marker line.

Above the marker, a file holds only its docstring and the imports that let it be linted (and, for
shared.py, imported by the package); the names a module's generated preamble and kernel templates
define are pyflakes builtins there (attngen.emit.module.LINT_BUILTINS).
"""
