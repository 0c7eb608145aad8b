"""Routing and training diagnostics: the routing recorder (:mod:`.recorder`), the site x
source routing maps (:mod:`.maps`), a run's metrics records (:mod:`.records`) and its loss
curves (:mod:`.loss_curves`). Used by the training driver, the demo and ``mhar-analyze``;
nothing here imports the training driver.
"""
