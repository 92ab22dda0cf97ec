"""pdserve: LLM serving with prefill and decode disaggregated.

Importing this package (and any module of the shared core outside `pdserve.models`,
`pdserve.engine` and `pdserve.bench`) never imports torch or Ray.
"""

__version__ = "0.1.0"
