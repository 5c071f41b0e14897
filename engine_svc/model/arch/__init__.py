"""The decoder every family runs, and the families: what a checkpoint's ``config.json``
means for the arithmetic, in plain torch.

    args.py         ModelArgs: the decoder's shape and options, refused field by field
    families.py     one entry per served ``architectures`` name -> FamilyOptions
    rope_config.py  RoPE settings from ``config.json`` (4.x and 5.x layouts)
    rope.py         rotary position embeddings (default, llama3, yarn, longrope)
    layers.py       attention, the gated MLP, RMSNorm
    moe.py          a mixture of experts in place of the MLP
    llama.py        Transformer: the decoder itself

A new family is an entry in ``families.py`` (and, where it needs one, an option in
``args.py`` honoured by ``layers.py`` / ``llama.py``); it imports nothing of ``load/``.
"""
