"""The machine: a fast BLAS proven to run on this CPU (imports no mlx), and the layout of the caches
under ``mlx.launch`` (tensor- and pipeline-parallel shards)."""
