"""The decode plan: which forward body, linear forms and head this model runs with here, chosen once at load and proved by the start check."""
