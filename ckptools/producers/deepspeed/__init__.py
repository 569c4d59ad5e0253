"""DeepSpeed ZeRO 1/2/3 checkpoints, read without DeepSpeed: the rank files, ZeRO's flat
partitions placed on each parameter, and its optimizer named as torch's FQN-keyed state dict."""
