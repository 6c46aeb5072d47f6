"""Low precision: bf16/fp16 parameters with fp32 masters, dynamic loss scaling, FP8."""
