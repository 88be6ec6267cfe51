"""Cluster jobs: SLURM scripts and Kubernetes manifests for multi-node runs."""
