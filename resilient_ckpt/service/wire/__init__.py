"""The service's wire format: message types and schemas, envelope encode/decode with limits,
flow control, HMAC authentication and the replay guard. Imports ``errors`` only."""
