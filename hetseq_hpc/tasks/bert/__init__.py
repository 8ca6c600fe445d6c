"""BERT masked-language modelling on packed text."""
