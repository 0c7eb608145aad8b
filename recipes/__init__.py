"""The run recipes (YAML), installed as the package data ``megatron_mhar.recipes``: this file
makes the folder a package, which is what lets an editable install map it there."""
