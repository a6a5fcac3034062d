"""The route decorator and its endpoint (`guards.routes`): signatures, OpenAPI, declarations
checked at start-up, effort routing, and the attribution headers."""
