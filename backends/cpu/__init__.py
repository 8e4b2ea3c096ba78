"""The CPU package: C kernels on the file's own quantized blocks, and the Python that drives them.

* ``*.c``, ``x86/*.c`` (one extension module, ``_kernels``; ``kernels.h`` says
  which file holds what) and :mod:`.kernels`, the one Python door to them;
* :mod:`.backend`: every op of the contract on numpy arrays and those kernels
  (the registered ``numpy`` backend is this class under its name);
* :mod:`.record` and :mod:`.plan`: a decode step recorded as one program of
  kernel calls and replayed in one C call (numpy's and torch/cpu's);
* :mod:`.recurrent` and :mod:`.mxfp4`: Mamba2's chunked scan and MXFP4 products.

Backends compose this package (torch/cpu imports it, never the numpy backend);
nothing here imports a framework.
"""
