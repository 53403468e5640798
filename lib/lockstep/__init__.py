"""lockstep: train a chat model from scratch as a DAG of reproducible stages. The package root
does no work at import; import the submodule you need."""

__version__ = "0.1.0"
