"""The drafter and its checkpoint: config, weights, the DFlash module and its DFlash2 parts, features, token map."""
