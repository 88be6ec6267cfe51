"""What a run reports: metrics records, trackers, FLOPs and MFU, console progress, the plot and the outcome."""
