"""The built-in models, apart from the light core and imported only when one is asked
for (``kvhandoff.model.resolve_model``): the generator (``generate``), the models' shapes
and seeded weights (``shapes``), the synthetic two-stage corpus (``corpus``) the built-in
model is trained on (``train``), its special tokens (``tokens``) and random LoRA
adapters for it (``adapters``)."""
