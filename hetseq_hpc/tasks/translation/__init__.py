"""German-to-English translation with an encoder-decoder transformer (``task=translation``)."""
