"""The DSpark block drafter: training data, model, training, calibration, export."""
