"""Imported first by the worker processes' forkserver (``process.mp_context``): importing it
quiets the libraries the server preloads after it (transformers imports torchao as it loads its
quantizers). The one module whose import changes process state, on purpose: the preload list
can only import."""

from mixrl.system.quiet import silence_libraries

silence_libraries()
