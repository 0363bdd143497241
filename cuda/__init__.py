"""CUDA sources of the kdtree kernels (one .cu per kernel family), shipped inside the package."""
