"""GPT models with MHAR decoders: config, layer, block, specs and the builder."""
