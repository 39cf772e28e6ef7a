"""What a checkpoint is: the quantization primitives, packed linears and experts, reading and writing folders and
shards, the family table and model loading. The runtime imports this package and nothing else of compress; it
imports nothing from the methods, the transforms or compress's top level."""
