"""tilecomm.dispatch: MoE token dispatch/combine on tilecomm.language. Not built yet: see the
project's dispatch issue. Importing it is safe; it exports nothing so far."""
__all__: list = []
