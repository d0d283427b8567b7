"""The KV cache (and recurrent state): past/present inputs and outputs inserted into a fused graph,
per-row lengths, the machinery sliced to the new tokens, the encoder split of a seq2seq."""
