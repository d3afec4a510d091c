"""The runtime: meshes and launch, 4D kernels, per-stage programs, transports."""
