"""The engine client: one bidi stream per engine, a handle per request, routing over the
engines, and plain types for the rest of the frontend. Only the protobuf conversion
(convert.py) and the session that opens the streams (client.py) know the engine protocol."""
